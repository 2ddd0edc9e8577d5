"""The ground every part of overstory may use: typed configs, experiment tracking, memory sampling.

Nothing here imports another part of overstory; the parts import this.
"""
