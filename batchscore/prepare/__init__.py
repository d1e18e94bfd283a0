"""Everything before planning: find the job's files and model (`job.py`), read rows and render
prompts (`prompts.py`, `jinja.py`), the options each row is scored on (`options.py`), and
generated inputs (`synthetic.py`). A face only: it imports nothing."""
