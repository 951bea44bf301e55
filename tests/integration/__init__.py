"""Whole models fitted end to end against exact answers, NUTS references and the examples."""
