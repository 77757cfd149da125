"""The cycle runner, shared by `timeshare run` and `timeshared`: it performs what state/ decides.

runner.py    `run_cycle`: advance the machine, plan, perform; one inbox of what happened
nodes.py     this node's dealings with the other nodes: its beat, the crossings at fences,
             its last word, a node or the store lost
phases.py    performing one piece: a phase on a rank's two workers, a barrier meeting, a check
commands.py  the job store's commands, turned into the machine's events
workers.py   the seam to the workers (`Workers`) and their real processes (`spawn_workers`)
zygote.py    the worker factory: loads the workers' code once, forks each worker (factory.py:
             the driver's end)
hooks.py     how a front end watches and steers a run, and what it is told
telling.py   telling it: the hooks, the run's summary, the timeline's records (also logged)
records.py   the timeline's records: each phase of a rank, each mark of the driver's
steps.py     one step's figures, from the phase reports: the run summary's and the service's

Nothing is imported here: `timeshare report` reads records.py and steps.py without the
runner's imports (torch among them); import each from its module.
"""
