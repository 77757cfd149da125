"""What a run did, read back from its directory (where `timeshare run --summary` wrote).

run_dir.py   the directory: its per-step figures (summary.json), with clear errors
table.py     the per-phase table: median, p90 and max of each phase, sync GB/s, bubble
scalars.py   TensorBoard scalars of every step ([log].tensorboard), written as the run goes
"""
