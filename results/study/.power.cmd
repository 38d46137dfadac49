ripplekv.pipeline.study.run.write_power results/study/pilot
