"""Ways to run the engines: in this process (batchscore.scoring) or across Ray actors."""
