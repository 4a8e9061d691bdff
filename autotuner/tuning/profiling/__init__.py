"""The profile: its launches (launches.py), the job as settled and as the profile leaves it
(job.py), and the phase that runs it (phase.py)."""
