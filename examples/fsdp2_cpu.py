"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU through Lightning's
``ModelParallelStrategy``.

    python examples/fsdp2_cpu.py fit --config configs/fsdp2_cpu.yaml
    seqmem plan --config configs/fsdp2_cpu.yaml --lengths 1024 4096 --world-size 8 --strategy fsdp2

``ShardedLitGPT`` is the reference :class:`~lightning_seqmem.reference.demo.LitGPT` whose
``configure_model()`` shards every transformer block and then the root with ``fully_shard`` over the
strategy's device mesh (``self.device_mesh``, data-parallel dimension), as torchtitan does. Each
rank then holds ``1/N`` of the parameters, gradients and AdamW state; a block's full parameters
exist only while it runs (all-gathered before its forward and again before its backward, freed
after).

``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` runs on CPU with the gloo
backend; Lightning's ``FSDPStrategy`` (FSDP1) refuses ``accelerator="cpu"``.

Example:
    >>> lit = ShardedLitGPT(n_layer=1, d_model=32, n_head=2)
    >>> lit.configure_model()  # no device mesh (no ModelParallelStrategy): nothing is sharded
    >>> type(lit.model.blocks[0]).__name__
    'Block'
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from lightning_seqmem.reference.demo import LitGPT, SyntheticTokenDataModule


class ShardedLitGPT(LitGPT):
    """:class:`~lightning_seqmem.reference.demo.LitGPT` sharded with FSDP2 in ``configure_model()``.

    Args: those of :class:`~lightning_seqmem.reference.demo.LitGPT`, plus

        reshard_after_forward: free each block's gathered parameters after its forward (ZeRO-3,
            the default) or keep them until backward (``False``: ZeRO-2-like, more memory, one
            all-gather fewer).
    """

    def __init__(self, *args, reshard_after_forward: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reshard_after_forward = bool(reshard_after_forward)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = self.device_mesh  # set by ModelParallelStrategy; None otherwise
        if mesh is None or isinstance(self.model, FSDPModule):
            return
        dp_mesh = (mesh["data_parallel"] if mesh.mesh_dim_names
                   and "data_parallel" in mesh.mesh_dim_names else mesh)
        for block in self.model.blocks:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(self.model, mesh=dp_mesh, reshard_after_forward=self.reshard_after_forward)


def main() -> None:
    # beside this file (sys.path[0] when run as a script)
    from train_gpt_cli import report  # noqa: PLC0415

    cli = LightningCLI(ShardedLitGPT, SyntheticTokenDataModule,
                       save_config_kwargs={"overwrite": True})
    if cli.subcommand == "fit":
        report(cli.trainer)


if __name__ == "__main__":
    main()
