"""The compute-node side: what every Slurm task (one training rank) runs.

Imports torch and Megatron-Core; of ``launch/`` it imports only the contract both sides share
(schema, composition of a saved config, run paths, vocabulary rule, rank environment, tokenizer).
"""
