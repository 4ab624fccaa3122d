"""What the learner trains on: prompt sources and the feeder, admission control, staleness, batch collection
and the collated train batch."""
