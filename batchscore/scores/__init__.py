"""Score math: raw option totals become the output's probabilities (`normalize.py`), which are
calibrated (`calibration.py`), given a confidence and a review threshold (`review.py`), and
added to the output as its calibration and review columns (`quality.py`). A face only: it
imports nothing."""
