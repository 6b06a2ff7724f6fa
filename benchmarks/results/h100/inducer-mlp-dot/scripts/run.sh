#!/bin/bash
# GPU experiment: inducer 16-bit MLP dots, FMA (default) vs tensor-core (KFUSED_EXPERIMENT_MLP_DOT=tc)
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)" >> $OUT/env.txt 2>&1
git rev-parse HEAD >> $OUT/env.txt 2>&1
CASES=('(2,8,2,2,0,96,3,1,3,False,"add",0,"float16",True)' '(2,2,1,2,3,80,17,5,3,True,"add",1,"float16",True)' '(1,8,2,17,300,128,17,1,65,True,"add",2,"bfloat16",True)' '(1,2,2,65,1,128,17,17,0,True,"add",0,"float16",True)' '(1,2,2,65,1,64,17,17,0,True,"add",0,"float16",True)')
for mode in fma tc; do
  i=0
  for a in "${CASES[@]}"; do
    i=$((i+1))
    ( if [ $mode = tc ]; then export KFUSED_EXPERIMENT_MLP_DOT=tc; fi
      CUDA_LAUNCH_BLOCKING=1 timeout 170 python3 tmp_gpu/h.py "$a" > $OUT/case_${mode}_$i.log 2>&1; echo "rc=$?" >> $OUT/case_${mode}_$i.log ) &
  done
done
( timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_inducer.py -k "kernel_against_reference or grouped_query" > $OUT/pytest_fma.log 2>&1; echo "rc=$?" >> $OUT/pytest_fma.log ) &
wait
cd $OUT && for f in case_*.log; do echo "== $f"; grep -v Warn $f | grep -E "FAIL|EXC|rc=|nan" | head -5; done > summary.txt; tail -3 pytest_fma.log >> summary.txt
