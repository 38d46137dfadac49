ripplekv needle --lengths 1024,2048,4096 --limit 6 --budget 128 --methods full,streamingllm,snapkv,pyramidkv,ripplekv --allocation results/allocation.csv --out results/needle
