ripplekv profile --signal evict --measure kl --evict-budget 128 --calib-samples 6 --calib-draw 0 --calib-draws 3 --probe-tokens 16 --target-tokens 1200 --out results/profile-evict-kl
