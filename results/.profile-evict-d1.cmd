ripplekv profile --signal evict --measure task-drop --prune-ratio 0.6 --calib-samples 6 --calib-draw 1 --calib-draws 3 --target-tokens 1200 --out results/draws/d1/profile-evict
