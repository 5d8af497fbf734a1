def xlstm_stack(E: int, S: int):
    """The xlstm package's xLSTMBlockStack with an mLSTM and an sLSTM block (vanilla backend), each
    with its CausalConv1d of kernel size 4, 4 heads; random weights."""
    from xlstm import (
        mLSTMBlockConfig,
        mLSTMLayerConfig,
        sLSTMBlockConfig,
        sLSTMLayerConfig,
        xLSTMBlockStack,
        xLSTMBlockStackConfig,
    )

    cfg = xLSTMBlockStackConfig(
        mlstm_block=mLSTMBlockConfig(mlstm=mLSTMLayerConfig(conv1d_kernel_size=4, qkv_proj_blocksize=4, num_heads=4)),
        slstm_block=sLSTMBlockConfig(slstm=sLSTMLayerConfig(backend="vanilla", num_heads=4, conv1d_kernel_size=4)),
        context_length=S, num_blocks=2, embedding_dim=E, slstm_at=[1])
    return xLSTMBlockStack(cfg)
