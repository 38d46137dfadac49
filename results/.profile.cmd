.venv/bin/ripplekv profile --calib-samples 12 --seeds 2 --eta 0.3 --probe-tokens 16 --target-tokens 3500 --out results/profile 
