//! `forward_writes!`: the `AsyncWrite` methods of a wrapper that passes
//! writes straight through to one of its fields.
//!
//! Transport wrappers here and in the services (`readahead::ReadAhead`,
//! `lingering::LingeringClose`, the broker's reset-on-drop client streams) change how a
//! connection reads or closes but not how it writes. The macro writes the pass-through once, and
//! includes the vectored writes a hand-written pass-through tends to forget (h2 and rustls write
//! vectored, and a wrapper without them turns each vectored write into several calls).

/// Inside `impl AsyncWrite for Wrapper`: forwards `poll_write`, `poll_write_vectored`,
/// `is_write_vectored`, `poll_flush` and `poll_shutdown` to `self.<field>` (which must be
/// `AsyncWrite + Unpin`, and `Self: Unpin`). With `, except_shutdown` the impl writes its own
/// `poll_shutdown`.
#[macro_export]
macro_rules! forward_writes {
    ($field:ident) => {
        $crate::forward_writes!($field, except_shutdown);

        fn poll_shutdown(
            self: ::std::pin::Pin<&mut Self>,
            cx: &mut ::std::task::Context<'_>,
        ) -> ::std::task::Poll<::std::io::Result<()>> {
            $crate::__tokio::io::AsyncWrite::poll_shutdown(
                ::std::pin::Pin::new(&mut self.get_mut().$field),
                cx,
            )
        }
    };
    ($field:ident, except_shutdown) => {
        fn poll_write(
            self: ::std::pin::Pin<&mut Self>,
            cx: &mut ::std::task::Context<'_>,
            buf: &[u8],
        ) -> ::std::task::Poll<::std::io::Result<usize>> {
            $crate::__tokio::io::AsyncWrite::poll_write(
                ::std::pin::Pin::new(&mut self.get_mut().$field),
                cx,
                buf,
            )
        }

        fn poll_write_vectored(
            self: ::std::pin::Pin<&mut Self>,
            cx: &mut ::std::task::Context<'_>,
            bufs: &[::std::io::IoSlice<'_>],
        ) -> ::std::task::Poll<::std::io::Result<usize>> {
            $crate::__tokio::io::AsyncWrite::poll_write_vectored(
                ::std::pin::Pin::new(&mut self.get_mut().$field),
                cx,
                bufs,
            )
        }

        fn is_write_vectored(&self) -> bool {
            $crate::__tokio::io::AsyncWrite::is_write_vectored(&self.$field)
        }

        fn poll_flush(
            self: ::std::pin::Pin<&mut Self>,
            cx: &mut ::std::task::Context<'_>,
        ) -> ::std::task::Poll<::std::io::Result<()>> {
            $crate::__tokio::io::AsyncWrite::poll_flush(
                ::std::pin::Pin::new(&mut self.get_mut().$field),
                cx,
            )
        }
    };
}
