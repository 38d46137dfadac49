ripplekv profile --signal evict --measure kl --evict-budget 128 --calib-samples 6 --calib-draw 1 --calib-draws 3 --probe-tokens 16 --target-tokens 1200 --out results/draws/d1/profile-evict-kl
