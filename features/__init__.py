"""The optional features a run applies, in one place and in order (features/apply.py's `apply`), as
torchtitan's `parallelize` applies parallelism to a model: each plugs into the seams of the run (runs/setup.py's
Run: the batch's `rollout`, `rows_of`, `draw`, `rewards` and `sample_options`; the update's `micro_batches`,
`reference`, `forward`, `forward_extras`, `objective`, `entropy_grad`, `old_logprobs`, `select_tokens`,
`backward`, `optimizer_step` and `after_optimizer_step`; the metrics' `step_metrics` and `update_metrics`) and the
core step (train.py) holds no branch on its setting. A default run applies none of them, and a default step
enters none of these files.

Each file here is one feature, read on its own: what it replaces or wraps, and its metrics.
    streaming.py          --rollouts_in_flight, --max_staleness: rows through a few decode places, scored as
                          their groups land; the sampler working ahead across steps
    stream_sampler.py     --max_staleness's sampler: rows that decode on across training steps (`Stream`)
    dynamic_sampling.py   --dynamic_sampling: draws until enough groups have a signal (DAPO)
    routing_replay.py     --routing_replay: the sampler's experts, replayed by the training forward's variant
    images.py             a vision-language policy's prompt images, through the training forward's variant
    shared_prompts.py     --shared_prompts: a group's rows trained as one tree over their prompt (TreeForward)
    sequence_parallel.py  --cp_size: a row's positions split over a group's processes in the training forward,
                          an all-to-all around each attention (Ulysses)
    lora_reference.py     --lora_rank with --beta: the reference is the policy with its adapters off
    code_execution.py     programs run in the sandbox during a step: their metrics
    token_selection.py    --top_entropy_quantile, --off_policy_mask_threshold: which tokens' policy terms count
    schedules.py          the small ones: the loss scale (float16), adaptive entropy, the reference's syncs
    sampler_options.py    the sampler's options: tensor-parallel groups, batches of rows, rows streaming through
                          places, kept decoders, CUDA graphs off, the Triton kernel, shared prefill, routing
                          records, images; the features' `sample`, `generate` and the start-up check's path;
                          a run's rollout and rows where it asks for any of them (`run.rollout`, `run.rows_of`)
    sampler_rows.py       rows with turns (stops, an environment's answers), admission and routing records
The layers' own features (tensor-parallel slices, MoE and recurrent layers, the Triton kernels, the model's own
forward) are in layers/, chosen where the decoder is built.

Imports: the top-level modules (sampling, rollouts, rewards, logprobs, sharding), runs/log.py, layers/ (lora,
routing) and sandbox/executor.py, and one another (this file imports none of them); only train.py imports
features/apply.py, and no core file imports a file of it.
"""
