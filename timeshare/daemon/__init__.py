"""The fronts of timeshare: the programs, and the service that runs the cycle for days.

cli.py         `timeshare`: run a job in the foreground, show a config, print the tables
foreground.py  `timeshare run`: progress on the terminal, the `--summary` file (summary.py)
main.py        `timeshared`: the daemon; paths, signals, systemd's timeouts and watchdog
service.py     the service: runs the cycle when wanted, follows it, keeps what it learns
requests.py    an operator's requests (pause, resume, drain, stop, reload, log level)
control.py     the control socket's server; ctl.py is its client, `timesharectl`
progress.py    what the service knows of its job; records.py keeps it on disk
metrics.py, health.py, systemd.py, watchers.py: Prometheus, the watchdog, sd_notify, `watch`
Importing this package first keeps torch's C++ warnings off the fronts' stderr (torch_quiet.py).
"""

from timeshare.torch_quiet import quiet_this_process

quiet_this_process()  # before anything here loads torch
