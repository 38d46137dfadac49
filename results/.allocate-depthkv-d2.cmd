ripplekv allocate results/draws/d2/profile-evict/sensitivity.csv --map proportional --floor 0.25 --out results/draws/d2/depthkv-d2.csv
