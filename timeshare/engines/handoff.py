"""The defaults of what crosses the worker hand-off (config -> WorkerSpec -> EngineContext -> an
engine), stated once: what a worker or an engine built without a job (a test, a benchmark) runs
with, and the config's own default where it has the key. A job's values come from its config
(cycle/workers.py derives them from [deadlines] and [job]). No imports: the config reads it.
"""

COLLECTIVE_TIMEOUT_S = 30.0  # each collective of the trainers' process group
CALL_TIMEOUT_S = 30.0  # each call into an engine's own processes (vLLM, SGLang)
GENERATE_TIMEOUT_S = 27.0  # a rollout's generate, unless its own settings give one
KEEP_CHECKPOINTS = 3  # the newest committed steps a trainer keeps on disk ([job])
