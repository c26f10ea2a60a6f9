"""Parallelism inside a replica (one concept per file, picotron-style).

- args.py: `ParallelismArgs`, the job's layout (replicas x pp x shard x tp) and its validation;
- context.py: `ParallelContext`, one rank's groups: its replica (the default
  process group, a ("shard",), ("shard", "tp") or ("pp", "shard", "tp") mesh) and the per-generation
  cross-replica communicators;
- tp.py: tensor parallelism (torch's DTensor ColwiseParallel / RowwiseParallel) of
  the GPT's attention and MLP over the replica's "tp" ranks;
- pp.py: pipeline parallelism (torch.distributed.pipelining, GPipe "afab" or "1f1b")
  of the GPT's blocks over the replica's "pp" ranks; a quota is one schedule run;
- fsdp.py: FSDP2 inside a replica and `ShardedAccumulator`, the sharded form of
  core/worker/accumulator.py's GradAccumulator;
- replica_link.py: the leader's relay of the coordinator's word to its ranks;
- follower.py: `ReplicaFollower`, the training API on a rank that is not the leader;
- rank_beats.py: every rank beats to its leader; a silent one ends the replica;
- join.py: `ReplicaContext`, the entry point of a user's FSDP2 loop (examples/hsdp_loop.py).

Conventions follow nanotron's (`ParallelContext`, `ParallelismArgs`, the rank-grid
order), which cannot be a dependency here.
"""
