//! Property tests: name validation against the rules, header encodings round trip, decoding
//! arbitrary bytes never panics and accepts only canonical encodings.

use proptest::prelude::*;
use tensormem_shm::name::MAX_NAME_LEN;
use tensormem_shm::transfer::{RegionHeader, HEADER_LEN, MAX_USER_DATA};
use tensormem_shm::{Error, NameGenerator, NameProblem, RefcountHeader, ShmName};

/// The naming rules, stated independently of the implementation's order of checks.
fn is_valid(name: &str) -> bool {
    match name.strip_prefix('/') {
        Some(rest) => {
            !rest.is_empty()
                && rest.len() <= MAX_NAME_LEN
                && !rest.contains('/')
                && !rest.contains('\0')
                && rest != "."
                && rest != ".."
        }
        None => false,
    }
}

/// Whether `problem` truly applies to `name`.
fn applies(problem: NameProblem, name: &str) -> bool {
    let rest = name.strip_prefix('/');
    match problem {
        NameProblem::NoLeadingSlash => rest.is_none(),
        NameProblem::Empty => rest == Some(""),
        NameProblem::InnerSlash => rest.is_some_and(|r| r.contains('/')),
        NameProblem::Nul => rest.is_some_and(|r| r.contains('\0')),
        NameProblem::TooLong => rest.is_some_and(|r| r.len() > MAX_NAME_LEN),
        NameProblem::DotName => rest == Some(".") || rest == Some(".."),
        _ => false,
    }
}

fn name_like() -> impl Strategy<Value = String> {
    prop_oneof![
        "[/a._\0-]{0,8}",
        "/[a-z0-9_./]{0,20}",
        "/[^/\0]{1,300}",
        "(/?)[a-zA-Z0-9_.\0/-]{0,270}",
        Just("/.".to_owned()),
        Just("/..".to_owned()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn names_are_accepted_exactly_when_the_rules_hold(name in name_like()) {
        match ShmName::new(name.clone()) {
            Ok(valid) => {
                prop_assert!(is_valid(&name), "{name:?} accepted");
                prop_assert_eq!(valid.as_str(), name.as_str());
                let path = valid.path();
                prop_assert_eq!(path.to_str().unwrap(), format!("/dev/shm/{}", &name[1..]));
                let file = path.file_name().unwrap();
                prop_assert_eq!(ShmName::from_file_name(file).unwrap(), valid);
            }
            Err(Error::InvalidName { name: reported, problem }) => {
                prop_assert!(!is_valid(&name), "{name:?} refused");
                prop_assert_eq!(&reported, &name);
                prop_assert!(applies(problem, &name), "{problem:?} does not apply to {name:?}");
            }
            Err(other) => prop_assert!(false, "unexpected error {other:?}"),
        }
    }

    #[test]
    fn bytes_and_str_validation_agree(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
        let from_bytes = ShmName::from_bytes(&bytes);
        match std::str::from_utf8(&bytes) {
            Ok(s) => prop_assert_eq!(from_bytes.is_ok(), ShmName::new(s).is_ok()),
            Err(_) => prop_assert!(from_bytes.is_err()),
        }
    }

    #[test]
    fn generated_names_are_valid_and_parse_back(prefix in "[A-Za-z0-9._-]{1,128}") {
        let generator = NameGenerator::with_prefix(prefix.clone()).unwrap();
        let name = generator.next_name();
        prop_assert!(is_valid(name.as_str()));
        let parts = name.parse_generated().unwrap();
        prop_assert_eq!(parts.prefix, prefix.as_str());
        prop_assert_eq!(parts.pid, std::process::id());
        prop_assert_ne!(generator.next_name(), name);
    }

    #[test]
    fn refcount_header_round_trips(refcount in any::<i32>(), padding in any::<[u8; 60]>()) {
        let header = RefcountHeader { refcount };
        let bytes = header.encode();
        prop_assert_eq!(&bytes[..4], &refcount.to_ne_bytes());
        prop_assert!(bytes[4..].iter().all(|&b| b == 0));
        prop_assert_eq!(RefcountHeader::decode(&bytes).unwrap(), header);
        // Padding is ignored, as PyTorch ignores it.
        let mut dirty = bytes;
        dirty[4..].copy_from_slice(&padding);
        prop_assert_eq!(RefcountHeader::decode(&dirty).unwrap(), header);
    }

    #[test]
    fn refcount_header_needs_64_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let is_out_of_bounds = matches!(RefcountHeader::decode(&bytes), Err(Error::OutOfBounds { .. }));
        prop_assert!(is_out_of_bounds);
    }

    #[test]
    fn region_header_round_trips(
        len in 1u64..,
        offset in any::<u64>(),
        read_only in any::<bool>(),
        user_len in 0..=MAX_USER_DATA as u16,
    ) {
        let header = RegionHeader { len, offset, read_only, user_len };
        prop_assert_eq!(RegionHeader::decode(&header.encode()).unwrap(), header);
    }

    #[test]
    fn region_header_decoding_accepts_only_canonical_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..48),
        valid_prefix in any::<bool>(),
    ) {
        let mut bytes = bytes;
        if valid_prefix && bytes.len() >= 8 {
            bytes[..8].copy_from_slice(b"TMSR\x01\x00\x00\x00");
        }
        match RegionHeader::decode(&bytes) {
            Ok(header) => {
                prop_assert_eq!(&header.encode()[..], &bytes[..HEADER_LEN]);
                prop_assert!(header.len > 0 && usize::from(header.user_len) <= MAX_USER_DATA);
            }
            Err(err) => prop_assert!(matches!(err, Error::Protocol { .. }), "{err:?}"),
        }
    }
}
