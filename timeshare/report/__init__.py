"""What a run did, read back from its directory (where `timeshare run --summary` wrote), or
written as it goes.

run_dir.py   the directory: its per-step figures (summary.json) and its log's timeline records
summary.py   the summary file: one line per step, appended as the run goes, and read back
table.py     the per-phase table: median, p90 and max of each phase, sync GB/s, bubble
picture.py   the picture: the last steps rank by rank, step time by phase, reward, sync rate
trace.py     the timeline as a Chrome trace (Perfetto): [log].trace as the run goes, or
             `timeshare trace RUN_DIR` from the log
scalars.py   TensorBoard scalars of every step ([log].tensorboard), written as the run goes
"""
