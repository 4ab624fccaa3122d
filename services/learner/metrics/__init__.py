"""What the learner reports: batch figures, the completions log, the metrics sink and experiment trackers."""
