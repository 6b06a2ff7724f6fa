import torch as t,sys,os
from kfused.testing import check_against_reference as C
from kfused.ops import inducer_attention as I
dev=os.environ.get("DEV","cuda");t.manual_seed(0)
B,H,K,q,k,p,L,rr,l,c,co,m,dt,ind=eval(sys.argv[1]);dt=getattr(t,dt);d=t.float64;n=lambda*s:t.randn(*s,dtype=d)
x=dict(q=n(B,H,q,p),k=n(B,K,k,p),v=n(B,K,k,p))
if ind:x.update(Ak=n(H,p,L)*.5,ak=n(H,L)*.5,Bk=n(H,L,p)*.5,ck=n(H,p)*.5,W1=n(H,p,rr)*.5,b1=n(H,rr)*.5)
if ind and co=="gate":x.update(W2=n(H,rr,p),b2=n(H,p))
if l:x.update(prefix_k=n(H,l,p),prefix_v=n(H,l,p))
if m==1:x["key_padding_mask"]=t.rand(B,k)>.3
if m==2:x["seq_lens"]=t.randint(0,k+1,(B,))
gn=sys.argv[2].split(",") if len(sys.argv)>2 else None
def mk(be):
 def f(q,k,v,**kw):
  o,u=I(q,k,v,composition=co,causal=c,backend=be,**kw);return o if u is None else(o,u)
 return f
try:
 for z in C(mk("triton"),mk("reference"),x,dt,dev,grad_names=gn):print(z.row(),z.detail[:150])
except Exception as e:
 import traceback;print("EXC",type(e).__name__,str(e)[:200]);print(traceback.format_exc()[-1200:])
