.venv/bin/ripplekv profile --signal evict --evict-budget 128 --calib-samples 6 --probe-tokens 16 --target-tokens 3500 --out results/profile-evict 
