"""The questions task: typed questions per record, one read per question (`task.py` registers it)."""
