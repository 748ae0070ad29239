"""What a run is built from and what it leaves behind, around the step in train.py.

    setup.py  what a run is built from: models, task, tools, optimizer, the start-up checks
    log.py    what a run writes for people to read: the step's line, metrics.jsonl, wandb
    cli.py    the command line and recipe files read into the Config dataclass, and --help
    disk.py   what a failed write's cause was (a full disk, a quota), said in one line
    export.py the trained model written out as a Hugging Face folder, one tensor at a time
    plan.py   the memory plan (`train.py --plan`): what each GPU and host process holds per phase, from the meta device
    weights.py  a model's weight files: a hub id's folder in the cache, safetensors and .bin files, MXFP4
                experts, and one process's rows of them

Imports: cli.py, disk.py and weights.py import nothing of the project (config.py, sharding.py and model_loading.py
use them); setup.py, log.py, plan.py and export.py import the top-level modules, and only train.py imports them
(features/ also imports log.py; plan.py: also layers/ and config.py, for its table; export.py: sharding.py and
layers/lora.py).
"""
