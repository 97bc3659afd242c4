"""Scheduling of the chunk stages: the sequence split (forward) and the segmented backward."""
