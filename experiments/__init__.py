"""The pipeline, exactly what the Snakefile runs: one module per experiment (e<N>_*.py), each a CLI that reads
experiments/config.yaml, runs and writes a CSV; the steps before them (verify, floors, the tuners,
distill_grouped) and after (merge_shards); the peers' adapters (vllm_moe); and the code they share (common,
dk, seed_dk, _io, runs_archive, pipeline, gpu_slot, schedule). The probes, one-off investigations the
pipeline does not run, live in probes/ and import from here, never the other way round."""
