"""Pure file formats: where bytes live in torch.save zip files and safetensors files, and the one
tensor index of a checkpoint file or folder (:mod:`.index`).
Nothing here moves tensor bytes or opens handles."""
