"""flower-shard: FL+FSDP and FL+HSDP, sharded data parallel groups averaged across slow networks.

N ranks form G groups of K ranks. Inside a group the model trains with FSDP2 or HSDP every step;
between groups the parameters are averaged every T local steps (one round), optionally through an
outer optimizer (DiLoCo's Nesterov).
"""

__version__ = "0.1.0"
