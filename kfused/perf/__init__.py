"""Static performance model and compiled-code checks (``kfused perf``). No GPU needed.

compile.py  record launches, compile as the JIT specialises, cubin/SASS statistics, cache
trace.py    run an op fwd+bwd on CPU stand-ins: Triton launches + torch glue
roofline.py H100 constants and the predicted-time formula
cases.py    benchmark cases, kernel models (issued FLOPs / bytes), baselines, targets
grounding.py tutorial-style kernels with public H100 figures, to check the model
report.py   the command: JSON, table, structural violations (ratchet)
"""
