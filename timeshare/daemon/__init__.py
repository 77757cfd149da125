"""The service side of timeshare: the command line (driver, control, systemd glue to come)."""
