.venv/bin/ripplekv allocate results/gemma3/profile/sensitivity.csv --model gemma3-270m --ratio 8 --budget 128 --calib-samples 4 --target-tokens 1000 --out results/gemma3/allocation.csv 
