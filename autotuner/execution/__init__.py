"""How experiments run: the cold, warm and Ray runners (the Runner protocol they implement is
tuning/trials/runner.py), and placement on a cluster."""
