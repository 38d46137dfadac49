.venv/bin/ripplekv profile --signal infonce --calib-samples 7 --target-tokens 1200 --out results/profile-infonce 
