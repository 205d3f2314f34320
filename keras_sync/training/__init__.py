"""What `Sync.fit` runs on: input pipeline, scaling, schedules, runtime switches, replica probe, saving, resume."""
