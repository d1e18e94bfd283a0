"""The tasks: one adapter per kind of job, behind the protocol in `batchscore/task.py` (`labels.py`,
`questions/`)."""
