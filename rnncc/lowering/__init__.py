"""Lowering: a cell and its sizes to TE components, scheduled, then assembled into one module.

``components`` builds each piece of the sequence (the projections, the cell's point-wise step,
the weight packing) as a TE PrimFunc; ``schedules`` (rnncc.schedules) turns each into device
code; ``assemble`` nests the scheduled pieces into one PrimFunc that loops over time.
"""
