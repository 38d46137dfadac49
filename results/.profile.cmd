.venv/bin/ripplekv profile --calib-samples 8 --seeds 2 --eta 0.3 --probe-tokens 16 --target-tokens 1200 --out results/profile 
