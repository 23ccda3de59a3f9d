// How the library's C entry points report errors (ops.cpp, dist.cpp): the message of any
// exception written into the caller's buffer, never an exception across into Rust.
#pragma once

#include <c10/util/Exception.h>

#include <cstring>
#include <exception>
#include <string>

namespace attnsweep {

inline void write_error(char* err, size_t len, const std::string& msg) {
    if (!err || len == 0) return;
    std::strncpy(err, msg.c_str(), len - 1);
    err[len - 1] = '\0';
}

// f(), or `failed` with the message of the exception it threw written to err.
template <typename R, typename F>
R guarded(char* err, size_t err_len, R failed, F f) {
    try {
        return f();
    } catch (const c10::Error& e) {
        write_error(err, err_len, e.what_without_backtrace());
    } catch (const std::exception& e) {
        write_error(err, err_len, e.what());
    }
    return failed;
}

}  // namespace attnsweep
