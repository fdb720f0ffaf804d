"""The process side: Ray, the trainer ranks as actors, and the drivers that run them.

- :mod:`.wiring` — the environment a trainer rank joins its torch.distributed world with
- :mod:`.worker` — :class:`TrainerWorker`, one trainer rank (and the RL step on it) as a Ray actor
- :mod:`.cluster` — starting Ray and the trainer actors (placement groups, rendezvous)
- :mod:`.trainer_group` — the supervised group of trainer actors (replaced when one dies)
- :mod:`.loop` — the driver loop: a snapshot per step to every rank, the report to the controller
- :mod:`.startup` — the start-up both drivers share (controller, adapters, trainers, metrics log)
- :mod:`.run` / :mod:`.service` — the one-shot and the service driver
- :mod:`.tinker_ranks` — the Tinker server over several trainer ranks (rank 0 here, followers spawned)
- :mod:`.metrics` — metrics logging (wandb, JSONL, console) and the reward plot
"""
