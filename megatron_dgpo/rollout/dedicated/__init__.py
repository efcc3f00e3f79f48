"""Dedicated rollout engines: vLLM on GPUs of their own, outside the trainer's world, refitted by
a weight broadcast, optionally generating one batch ahead (``rollout.placement: dedicated``).

    torchrun world  [ trainer ranks 0 .. T-1           | rollout ranks T .. T+R-1              ]
                      Megatron's world (TP x CP x PP x DP)  E = R / t engines of t ranks (vLLM TP)

``parallel.split_world`` gives each side its own default world, so Megatron and vLLM
(``external_launcher`` over the rollout ranks, as a colocated engine) each see only their own
ranks. DP replica d owns engines [d k, (d + 1) k), k = E / D, and talks to them through a
``comm.PeerGroup`` of 1 + k t members: index 0 is the replica's leader (the first rank of its
TP x CP x PP replica group, where ``export_hf_groups(consumer="first")`` delivers the full HF
tensors), then the engines' ranks in order. Only the replica's own samples reach it (samples
never cross DP) and each replica refits its own engines: nothing funnels through global rank 0.
The link is tried when it is made: ``PeerGroup`` sends one checked broadcast on its tensor
channel at creation (NCCL opens its communicator there), so a broken link between trainer and
engine nodes fails at start with the group's name, not after the collective timeout at the
first refit.

Protocol: the leader broadcasts a command, every engine rank takes part.

* ``start`` (once, ``hf_dir``): the engines build vLLM from the policy's config with random
  weights (the first refit fills them) and load the prompts.
* ``generate`` (``start``, ``positions``, ``batch_prompts``, ``refill_rounds``): engine i of
  the replica samples its contiguous share of the replica's batch positions with the seeds of
  their global prompt index (``placement.prompt_seeds``, so the samples are those of any other
  placement), its leader grades them and *sends* them back. The trainer's leader receives them
  when it needs them (``collect``): meanwhile the engines generate and the trainer trains.
* ``refit`` (``version``), then per bucket ``bucket`` (the tensors' names, shapes, dtypes) and
  one tensor broadcast of the bucket's bytes, then ``end``: the buckets are
  ``refit.bucket_groups``' (a fused q/k/v, gate/up or experts group is never split) and
  each is reloaded in place as a colocated engine's (``VLLMEngine.load_bucket``). Every engine
  rank answers ``ok`` or its error, which the leader raises.
* ``stop``: the engines shut down and their ranks exit 0.

The modules: ``server`` (the engine ranks' command loop), ``client`` (``DedicatedRollout``, the
trainer ranks' side), ``wire`` (the link's layout and a weight bucket's wire format); the loop
reaches both sides through ``rollout.start``, and keeps the batch generated ahead in a
checkpoint with ``rollout.ahead``.

One-step-off (``rollout.max_staleness: 1``, the trainer's loop): ``submit`` batch k+1 with the
engines' weights of step k-1 before the update of step k, ``collect`` it after; the refit with
step k's weights follows, between batches. A batch carries the version of the weights that
sampled it (``Experience.policy_version``). The engines report the time they waited for a
command before each batch (``time/engine_idle``) and their generation time
(``time/engine_generate``); the trainer times its own wait (``time/rollout_wait``).
A checkpoint keeps the batch generated ahead (``save_ahead``), so a resumed run continues with
the very samples the uninterrupted run used.

Streaming (``rollout.max_staleness`` >= 2 or ``rollout.partial``): after ``start`` the link
also opens a ``comm.Channel`` and the engines sample response by response; the leader's
``work``, ``interrupt`` and ``link`` (join the link's next command: ``refit`` or ``stop``)
commands and the engines' graded responses travel on it in the background (``stream`` holds
the leader's side, docs/rollout.md "Staleness and partial rollouts").
"""
