"""Parallelism inside a replica (one concept per file, picotron-style).

- args.py: `ParallelismArgs`, the job's layout (replicas x shard) and its validation;
- context.py: `ParallelContext`, one rank's groups: its replica (the default
  process group, a 1-D mesh) and the per-generation cross-replica communicators;
- fsdp.py: FSDP2 inside a replica and `ShardedAccumulator`, the sharded form of
  core/accumulator.py's GradAccumulator;
- replica_link.py: the leader's relay of the coordinator's word to its ranks;
- follower.py: `ReplicaFollower`, the training API on a rank that is not the leader;
- rank_beats.py: every rank beats to its leader; a silent one ends the replica;
- join.py: `ReplicaContext`, the entry point of a user's FSDP2 loop (examples/hsdp_loop.py).

Conventions follow nanotron's (`ParallelContext`, `ParallelismArgs`, the rank-grid
order), which cannot be a dependency here (see DESIGN.md section 5).
"""
