"""Pipeline parallelism: one lane's micro-batches through its stages in schedule order, and
stage boundaries and weights that cross worker processes."""
