"""Tensor parallelism over torch.distributed: the rank group (`group`), the ranks kvq starts itself
(`launch`), what each rank loads (`shard`) and the loop the ranks past 0 run (`worker`)."""
