ripplekv allocate results/profile-evict/sensitivity.csv --map proportional --floor 0.25 --out results/depthkv.csv
