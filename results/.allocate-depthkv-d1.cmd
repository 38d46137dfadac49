ripplekv allocate results/draws/d1/profile-evict/sensitivity.csv --map proportional --floor 0.25 --out results/draws/d1/depthkv-d1.csv
