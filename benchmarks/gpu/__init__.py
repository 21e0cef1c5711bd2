"""The DSpark pool on a borrowed GPU machine, measured and trained, each in one prepared command.

The machines this project can borrow are short-lived: about 15 minutes in all, at most 10 a command, 64 MiB of files
sent a call (the working tree included), at most 8 result files of 16 MiB back, no network, gone after 30 s idle.
So everything is prepared here (:mod:`benchmarks.gpu.cargo`: the wheels our code needs beyond the machine's own
torch, and the default model's GGUF, in as many calls as the room a call leaves takes), each command checks what
it needs in seconds first (:mod:`benchmarks.gpu.preflight`), and each writes what every stage found as the stage
ends, so a run cut short still returns what it did (:mod:`benchmarks.gpu.stages`):

* ``python -m benchmarks.gpu.serve RESULTS``: the default model rebuilt from its GGUF, the target's cost curve on
  the device, ``bench decode`` (greedy mismatches, tokens a forward, DSpark against our own AR on the same device)
  and ``bench batching`` at 1 to 64 concurrent requests;
* ``python -m benchmarks.gpu.train RESULTS``: ``train all`` over the shipped corpus, continued from the shipped
  drafter, checkpointing as it goes; the drafter comes back in files under 16 MiB.

Both run on the CPU too (``--device cpu``, a tiny model): the test suite's dry run keeps them working between GPU
runs.
"""
