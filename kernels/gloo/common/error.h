// Named by ProcessGroupGloo.hpp; dist.cpp uses none of Gloo's error types (see ../algorithm.h).
#pragma once
