"""How moegemm measures: timing (two clocks), provenance, floors and result records.

This package only measures and describes; writing files is the experiments' job.
"""
