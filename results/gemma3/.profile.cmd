.venv/bin/ripplekv profile --model gemma3-270m --calib-samples 4 --seeds 1 --eta 0.3 --probe-tokens 16 --target-tokens 1000 --out results/gemma3/profile 
