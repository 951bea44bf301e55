"""The golden plan tables: ``plan.describe()`` of every reference, benchmark and example model."""
